"""Host side of flexlab's CuTeDSL kernels: which kernel serves which GPU, the compile cache, and the fast launch.

Importing this package is cheap; cutlass is imported only when something is compiled or launched.
"""
