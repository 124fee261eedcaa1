import sys

from .emulate import main

sys.exit(main())
