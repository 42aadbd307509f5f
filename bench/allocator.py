"""The glibc allocator settings that the benchmarks give every variant alike.

glibc's malloc decides from each process's own history whether a freed buffer of a few MB goes
back to the operating system: its mmap and trim thresholds rise to the largest buffer the process
has freed so far. A process whose set-up never freed a big buffer therefore unmaps and maps again
its 4 MB gradients every step, and each step faults their pages in afresh: in the MNIST loop one
process took 400,000 page faults and 30-40% longer, while a torchmn rank, whose set-up happens to
free a 7 MB buffer, took 5,000. Which variant suffers depends on accidents (the size of the
validation set decided it for one process), so every variant runs with the same fixed thresholds,
high enough that none of them returns memory mid-training.
"""
ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": str(64 << 20), "MALLOC_TRIM_THRESHOLD_": str(256 << 20)}
