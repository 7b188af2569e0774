"""Code generators. `c` writes C/OpenMP for CPUs; `compiler` turns C into a loaded shared object."""
