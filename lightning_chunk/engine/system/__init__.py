"""What the process and the machine offer: libc calls, glibc's heap, the page cache, which processes share a host,
directory swaps a kill cannot split, a step's time by cause, host memory page-locked to the byte."""
