/* mpibench: time Open MPI's collectives back to back, as collbench times tutti's.
 *
 *   mpirun -np N --mca btl tcp,self mpibench COLL MINBYTES MAXBYTES [SECONDS]
 *
 * COLL: allreduce, allgather, reduce_scatter, alltoall, broadcast or sendrecv. Sizes are
 * nccl-tests' S in bytes (float elements), doubling from MINBYTES to MAXBYTES. For each size:
 * 3 warm-up calls, then calls back to back for about SECONDS (default 0.3, the same number of
 * calls on every rank: 5 timed calls, the slowest rank's, set the count), timed as a whole. Prints one
 * line per size: bytes, mean µs per call (averaged over ranks), algbw and busbw in GB/s by
 * nccl-tests' formulas. The first element of every output is checked against the exact sum.
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static double bus_factor(const char *coll, int n) {
    if (!strcmp(coll, "allreduce")) return 2.0 * (n - 1) / n;
    if (!strcmp(coll, "allgather") || !strcmp(coll, "reduce_scatter") || !strcmp(coll, "alltoall"))
        return (double)(n - 1) / n;
    return 1.0;
}

static int one(const char *coll, float *a, float *b, size_t count, int n, int rank) {
    size_t per = count / (size_t)n;
    if (!strcmp(coll, "allreduce"))
        return MPI_Allreduce(a, b, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    if (!strcmp(coll, "allgather"))
        return MPI_Allgather(a, (int)per, MPI_FLOAT, b, (int)per, MPI_FLOAT, MPI_COMM_WORLD);
    if (!strcmp(coll, "reduce_scatter"))
        return MPI_Reduce_scatter_block(a, b, (int)per, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    if (!strcmp(coll, "alltoall"))
        return MPI_Alltoall(a, (int)per, MPI_FLOAT, b, (int)per, MPI_FLOAT, MPI_COMM_WORLD);
    if (!strcmp(coll, "broadcast"))
        return MPI_Bcast(a, (int)count, MPI_FLOAT, 0, MPI_COMM_WORLD);
    if (!strcmp(coll, "sendrecv")) {
        int to = (rank + 1) % n, from = (rank + n - 1) % n;
        return MPI_Sendrecv(a, (int)count, MPI_FLOAT, to, 0, b, (int)count, MPI_FLOAT, from, 0,
                            MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    }
    return -1;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, n;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    if (argc < 4) {
        if (rank == 0) fprintf(stderr, "usage: mpibench COLL MINBYTES MAXBYTES [SECONDS]\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    const char *coll = argv[1];
    size_t lo = strtoull(argv[2], NULL, 10), hi = strtoull(argv[3], NULL, 10);
    double secs = argc > 4 ? atof(argv[4]) : 0.3;
    if (rank == 0) printf("# mpibench %s np %d\n#%11s %12s %8s %8s\n", coll, n, "bytes", "time_us", "algbw", "busbw");
    for (size_t bytes = lo; bytes <= hi; bytes *= 2) {
        size_t count = bytes / sizeof(float);
        if (count < (size_t)n) count = (size_t)n;
        count -= count % (size_t)n;
        float *a = malloc(count * sizeof(float)), *b = malloc(count * sizeof(float));
        for (size_t i = 0; i < count; i++) { a[i] = (float)(rank + 1); b[i] = 0; }
        for (int w = 0; w < 3; w++)
            if (one(coll, a, b, count, n, rank) != MPI_SUCCESS) MPI_Abort(MPI_COMM_WORLD, 1);
        /* How many calls fit in `secs`: 5 timed calls, the slowest rank's time, on every rank. */
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        for (int i = 0; i < 5; i++) one(coll, a, b, count, n, rank);
        double probe = (MPI_Wtime() - t0) / 5;
        MPI_Allreduce(MPI_IN_PLACE, &probe, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        long iters = (long)(secs / (probe > 1e-7 ? probe : 1e-7));
        if (iters < 5) iters = 5;
        MPI_Barrier(MPI_COMM_WORLD);
        t0 = MPI_Wtime();
        for (long i = 0; i < iters; i++) one(coll, a, b, count, n, rank);
        double per = (MPI_Wtime() - t0) / iters;
        double mean;
        MPI_Allreduce(&per, &mean, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
        mean /= n;
        /* The exact first element (broadcast and sendrecv move rank data, the rest sum). */
        float want = !strcmp(coll, "broadcast") ? 1.0f
                   : !strcmp(coll, "sendrecv") ? (float)((rank + n - 1) % n + 1)
                   : !strcmp(coll, "allgather") || !strcmp(coll, "alltoall") ? 1.0f
                   : (float)n * (n + 1) / 2 * 1.0f;
        float got = !strcmp(coll, "broadcast") ? a[0] : b[0];
        int bad = got != want;
        MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
        double algbw = (double)(count * sizeof(float)) / mean / 1e9;
        if (rank == 0)
            printf(" %11zu %12.2f %8.3f %8.3f%s\n", count * sizeof(float), mean * 1e6, algbw,
                   algbw * bus_factor(coll, n), bad ? "  WRONG" : "");
        free(a);
        free(b);
    }
    MPI_Finalize();
    return 0;
}
