"""C++ kernels for the CPU path, compiled on this machine by the install step (`make`)."""
