"""The compile cache: memory hits, disk round trip with checksums, and corrupt entries rebuilt (no GPU needed)."""
from __future__ import annotations

import dataclasses

from flexlab.kernels.config import default_config
from flexlab.runtime import compile as rc
from flexlab.runtime.disk_cache import export_name


class _FakeCompiled:
    def __init__(self, payload: bytes):
        self.payload = payload

    def export_to_c(self, path, function_name):
        with open(path, "wb") as f:
            f.write(self.payload)


def _key(**kw):
    base = dict(source_hash="h", has_score_mod=True, has_mask_mod=False, aux_tensor_specs=(), aux_scalar_kinds=(),
                dtype="bfloat16", config=default_config(128), arch="sm_90a", block_sparse=False, tile_order=False,
                cutlass_version="4.8.1", tvm_ffi=True)
    base.update(kw)
    return rc.CompileKey(**base)


def test_key_digest_changes_with_every_baked_in_field():
    k = _key()
    assert k.digest() == _key().digest()
    for change in (dict(source_hash="g"), dict(dtype="float16"), dict(config=default_config(64)),
                   dict(arch="sm_100a"), dict(cutlass_version="4.9"), dict(block_sparse=True),
                   dict(config=dataclasses.replace(default_config(128), num_stages=3)),
                   dict(kernel_source="edited"), dict(dsl_settings="lineinfo=True;")):
        assert _key(**change).digest() != k.digest(), change


def test_memory_then_disk_then_corrupt_rebuild(tmp_path, monkeypatch):
    builds = []

    def fake_build(key, mods, extra_options=""):
        builds.append(key)
        return _FakeCompiled(b"object-code-" + key.digest().encode())

    loaded = []

    def fake_load(path, enable_tvm_ffi):
        loaded.append(path)
        data = open(path, "rb").read()

        class M:
            def __getattr__(self, name):  # the exported function, looked up by its name in the object file
                return ("loaded", name, data)
        return M()

    monkeypatch.setattr(rc, "_build", fake_build)
    import cutlass.cute as cute
    monkeypatch.setattr(cute.runtime, "load_module", fake_load)
    key = _key()

    first = rc.KernelCache(tmp_path)
    fn = rc.forward_kernel(key, rc.KernelMods(), first)
    assert rc.forward_kernel(key, rc.KernelMods(), first) is fn and first.stats.memory_hits == 1 and len(builds) == 1
    obj, digest = first._paths(key)
    assert obj.exists() and digest.exists()

    second = rc.KernelCache(tmp_path)  # a new process: served from disk, no build
    assert rc.forward_kernel(key, rc.KernelMods(), second) == ("loaded", export_name(key), obj.read_bytes())
    assert second.stats.disk_hits == 1 and len(builds) == 1

    obj.write_bytes(b"garbage")  # corrupt the object: checksum mismatch -> deleted, rebuilt, re-stored
    third = rc.KernelCache(tmp_path)
    assert isinstance(rc.forward_kernel(key, rc.KernelMods(), third), _FakeCompiled)
    assert third.stats.rebuilt_corrupt == 1 and len(builds) == 2
    assert obj.read_bytes().startswith(b"object-code-")


def test_forward_fingerprint_follows_the_kernel_imports():
    """The forward's fingerprint covers fwd_sm90 and every kernel module it imports (the list it used to spell out),
    plus the module that builds its fake arguments."""
    from flexlab.runtime.disk_cache import source_files
    names = {p.name for p in source_files(("fwd_sm90",))}
    assert names == {"fwd_sm90.py", "softmax.py", "mask.py", "score_mod.py", "block_sparse.py", "layout.py",
                     "tile_scheduler.py", "carry.py", "config.py", "named_barrier.py", "stage_waits.py", "split_tail.py"}
    assert rc.kernel_fingerprint() == rc.source_fingerprint(("fwd_sm90",), extra_files=(rc.__file__,))
