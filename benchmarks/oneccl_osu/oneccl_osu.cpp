// oneccl_osu: OSU-style float32 sum allreduce latency over oneCCL on CPU buffers (issue 32).
// MPI launches the ranks and carries oneCCL's KVS address (the oneCCL sample pattern).
//   --timing loop: warmup, MPI_Barrier, ITERS calls back to back; per round the slowest rank's
//                  mean per call; the figure is the best round.
//   --timing osu:  per call ccl::barrier, t0, allreduce().wait(), t1; per call the slowest rank's
//                  t1-t0; the figure is the median over all calls of all rounds. avg/min/max: each
//                  rank's mean latency over all calls, then its average/min/max over ranks (OSU).
#include <mpi.h>
#include <oneapi/ccl.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

static double now_us() {
    using namespace std::chrono;
    return duration<double, std::micro>(steady_clock::now().time_since_epoch()).count();
}

static size_t parse_size(const char* s) {
    char* end = nullptr;
    double v = std::strtod(s, &end);
    switch (end && *end ? (*end | 0x20) : 0) {
        case 'k': v *= 1024; break;
        case 'm': v *= 1024 * 1024; break;
        case 'g': v *= 1024.0 * 1024 * 1024; break;
    }
    return (size_t)v;
}

int main(int argc, char** argv) {
    size_t min_b = 4096, max_b = 64u << 20;
    double factor = 2;
    int iters = 20, warmup = 5, rounds = 1;
    bool osu = false;
    for (int i = 1; i < argc; ++i) {
        std::string a = argv[i];
        const char* v = i + 1 < argc ? argv[i + 1] : nullptr;
        if (!v) { std::fprintf(stderr, "%s needs a value\n", a.c_str()); return 2; }
        ++i;
        if (a == "-b") min_b = parse_size(v);
        else if (a == "-e") max_b = parse_size(v);
        else if (a == "-f") factor = std::atof(v);
        else if (a == "-n") iters = std::atoi(v);
        else if (a == "-w") warmup = std::atoi(v);
        else if (a == "-R") rounds = std::atoi(v);
        else if (a == "--timing") osu = std::string(v) == "osu";
        else { std::fprintf(stderr, "usage: %s [-b MIN] [-e MAX] [-f FACTOR] [-n ITERS] [-w WARMUP] "
                            "[-R ROUNDS] [--timing loop|osu]\n", argv[0]); return 2; }
    }
    if (factor <= 1 || iters < 1 || rounds < 1 || warmup < 0) { std::fprintf(stderr, "bad arguments\n"); return 2; }

    int provided;  // oneCCL's MPI transport asks for MPI_THREAD_MULTIPLE
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    long total_wrong = 0;
    {  // oneCCL objects end before MPI_Finalize

    ccl::init();
    ccl::shared_ptr_class<ccl::kvs> kvs;
    ccl::kvs::address_type addr;
    if (rank == 0) {
        kvs = ccl::create_main_kvs();
        addr = kvs->get_address();
        MPI_Bcast(addr.data(), (int)addr.size(), MPI_BYTE, 0, MPI_COMM_WORLD);
    } else {
        MPI_Bcast(addr.data(), (int)addr.size(), MPI_BYTE, 0, MPI_COMM_WORLD);
        kvs = ccl::create_kvs(addr);
    }
    auto comm = ccl::create_communicator(size, rank, kvs);

    if (rank == 0) {
        auto ver = ccl::get_library_version();
        const char* alg = std::getenv("CCL_ALLREDUCE");
        const char* atl = std::getenv("CCL_ATL_TRANSPORT");
        std::printf("# oneCCL %u.%u.%u (%s)  CCL_ALLREDUCE=%s  CCL_ATL_TRANSPORT=%s  ranks=%d  timing=%s  iters=%d warmup=%d rounds=%d\n",
                    ver.major, ver.minor, ver.update, ver.full, alg ? alg : "(unset)", atl ? atl : "(unset)", size, osu ? "osu" : "loop",
                    iters, warmup, rounds);
        if (osu)
            std::printf("# time: median over calls of the slowest rank's call after ccl::barrier; avg/min/max: "
                        "each rank's mean, over ranks (OSU)\n"
                        "%12s %12s %12s %12s %12s %12s %8s\n", "size(B)", "count", "time(us)", "avg(us)",
                        "min(us)", "max(us)", "#wrong");
        else
            std::printf("# time: best round of the slowest rank's mean per call, back to back\n"
                        "%12s %12s %12s %8s\n", "size(B)", "count", "time(us)", "#wrong");
        std::fflush(stdout);
    }

    const float expect = size * (size + 1) / 2.0f;
    for (double b = (double)min_b; b <= (double)max_b; b *= factor) {
        const size_t count = std::max<size_t>(1, (size_t)b / sizeof(float));
        std::vector<float> send(count, float(rank + 1)), recv(count, -1.0f);
        auto call = [&] {
            ccl::allreduce(send.data(), recv.data(), count, ccl::datatype::float32, ccl::reduction::sum, comm).wait();
        };

        // Correctness: first call of this size.
        call();
        long wrong = 0, all_wrong = 0;
        for (size_t i = 0; i < count; ++i) wrong += recv[i] != expect;
        MPI_Allreduce(&wrong, &all_wrong, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
        total_wrong += all_wrong;

        double figure = 0, lat_avg = 0, lat_min = 0, lat_max = 0;
        if (!osu) {
            double best = 1e300;
            for (int r = 0; r < rounds; ++r) {
                for (int i = 0; i < warmup; ++i) call();
                MPI_Barrier(MPI_COMM_WORLD);
                double t0 = now_us();
                for (int i = 0; i < iters; ++i) call();
                double mean = (now_us() - t0) / iters, slowest = 0;
                MPI_Reduce(&mean, &slowest, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
                best = std::min(best, slowest);
            }
            figure = best;
        } else {
            std::vector<double> dt(iters), slowest(iters), all;
            double sum = 0;
            for (int r = 0; r < rounds; ++r) {
                for (int i = 0; i < warmup; ++i) { ccl::barrier(comm).wait(); call(); }
                for (int i = 0; i < iters; ++i) {
                    ccl::barrier(comm).wait();
                    double t0 = now_us();
                    call();
                    dt[i] = now_us() - t0;
                    sum += dt[i];
                }
                MPI_Reduce(dt.data(), slowest.data(), iters, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
                all.insert(all.end(), slowest.begin(), slowest.end());
            }
            double mean = sum / ((double)iters * rounds);
            MPI_Reduce(&mean, &lat_avg, 1, MPI_DOUBLE, MPI_SUM, 0, MPI_COMM_WORLD);
            MPI_Reduce(&mean, &lat_min, 1, MPI_DOUBLE, MPI_MIN, 0, MPI_COMM_WORLD);
            MPI_Reduce(&mean, &lat_max, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
            lat_avg /= size;
            if (rank == 0) {
                std::sort(all.begin(), all.end());
                size_t m = all.size();
                figure = m % 2 ? all[m / 2] : 0.5 * (all[m / 2 - 1] + all[m / 2]);
            }
        }
        if (rank == 0) {
            if (osu)
                std::printf("%12zu %12zu %12.2f %12.2f %12.2f %12.2f %8ld\n", count * sizeof(float), count, figure,
                            lat_avg, lat_min, lat_max, all_wrong);
            else
                std::printf("%12zu %12zu %12.2f %8ld\n", count * sizeof(float), count, figure, all_wrong);
            std::fflush(stdout);
        }
    }
    if (rank == 0 && total_wrong) std::printf("# FAILED: %ld wrong elements\n", total_wrong);
    }
    MPI_Finalize();
    return total_wrong ? 1 : 0;
}
