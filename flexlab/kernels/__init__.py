"""flexlab's own CuTeDSL attention kernels (Hopper sm90a).

Nothing here is imported by `import flexlab`: the modules import cutlass at load time, so callers reach them through
`flexlab.runtime` or `flexlab.backends.cute`, which import lazily.
"""
