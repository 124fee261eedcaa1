from torch_torus.bench.cli import main

main()
