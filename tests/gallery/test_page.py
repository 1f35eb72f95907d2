"""The static gallery page: PNG encoding, pictures that reflect the mask, and benchmark numbers picked up."""
from __future__ import annotations

import importlib.util
import json
import struct
import zlib
from pathlib import Path

import torch

from flexlab.gallery import get_variant

_spec = importlib.util.spec_from_file_location("gallery_render", Path(__file__).parents[2] / "gallery" / "_render.py")
render = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render)


def _decode_png(data: bytes) -> torch.Tensor:
    """Minimal decoder for the encoder's own output (8-bit RGB, filter 0 on every row)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, size = 8, b"", None
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        crc = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])[0]
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF
        if kind == b"IHDR":
            size = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height = size
    raw = torch.frombuffer(bytearray(zlib.decompress(idat)), dtype=torch.uint8).reshape(height, 1 + 3 * width)
    assert (raw[:, 0] == 0).all()
    return raw[:, 1:].reshape(height, width, 3)


def test_png_round_trip():
    rgb = torch.randint(0, 256, (7, 5, 3), dtype=torch.uint8)
    assert torch.equal(_decode_png(render.png_bytes(rgb)), rgb)


def test_causal_picture_is_lower_triangular():
    pics = render.variant_pictures(get_variant("causal"))
    mask = _decode_png(render.png_bytes(pics["mask"])).int()
    n = mask.shape[0]
    assert mask[n - 1, 0].sum() < 200 and mask[0, n - 1].sum() > 700  # bottom-left kept (dark), top-right white
    blocks = render.block_image(torch.tensor([[1, 0], [2, 1]], dtype=torch.int8))
    assert tuple(blocks[-2, 1].tolist()) == tuple(render.BLOCK_COLOURS[2].tolist())


def test_score_picture_for_a_score_variant():
    pics = render.variant_pictures(get_variant("alibi"))
    assert set(pics) == {"score"}
    pics = render.variant_pictures(get_variant("gemma2_local"))
    assert set(pics) == {"mask", "blocks", "curve"}  # softcap adds nothing to 0: its curve is drawn instead


def test_latest_results_merge_files_and_fill_the_card(tmp_path):
    def write(name, date, rows, gpu="H200", **doc):
        doc = doc or {"schema": 1}
        (tmp_path / name).write_text(json.dumps({"environment": {"date_utc": date, "gpu": gpu}, "rows": rows,
                                                 **doc}))

    row = "fwd softcap_causal B1 S1k"
    mods = "gallery:softcap(cap=20) + gallery:causal"
    peers = {"sdpa": {"status": "n/a", "error": "cannot express it"},
             "fa4": {"status": "ok", "wall_ms": 0.5, "tflops": 300.0, "rel_l2": {"out": 2e-3}},
             "flexlab": {"status": "n/a", "error": "kernel not landed"}}
    write("a_peers.json", "2026-01-01", [{"name": row, "variant": "softcap_causal", "mods": mods, "results": peers}])
    ours = {"flexlab": {"status": "ok", "wall_ms": 0.123, "tflops": 456.0, "rel_l2": {"out": 2e-3}},
            "fa4": {"status": "n/a", "error": "not run this time"}}
    write("b_ours.json", "2026-02-01", [{"name": row, "variant": "softcap_causal", "mods": mods, "results": ours}])
    write("c_probe.json", "2026-03-01", [{"cycles": 3}])  # rows without a name are not benchmark rows
    sweep = {"flexlab": {"status": "ok", "wall_ms": 9.9, "tflops": 1.0}, "-softmax": {"status": "ok", "tflops": 9.0}}
    write("d_sweep.json", "2026-04-01", [{"name": row, "variant": "softcap_causal", "mods": mods, "results": sweep}],
          ablations=["softmax"])  # a tuning sweep (no schema): its debug builds stay off the cards

    results = render.latest_results(tmp_path)
    assert set(results) >= {"softcap", "causal"}  # a combined row is listed under each variant it uses
    merged = results["softcap"][0]["results"]
    assert merged["flexlab"]["wall_ms"] == 0.123  # the newer real number replaces the older n/a
    assert merged["fa4"]["wall_ms"] == 0.5  # a newer n/a does not hide an older real number
    v = get_variant("softcap")
    card = render.render_card(v, render.variant_pictures(v), results["softcap"])
    assert "0.123 ms" in card and "456 TFLOPS" in card and "0.500 ms" in card and "cannot express it" in card
    assert card.count("data:image/png;base64,") == 1 and "def generate_softcap" in card and "score_mod(s)" in card
    assert "No GPU measurement" in render.render_card(v, {}, [])
    # a later run on another GPU is a row of its own, never merged into the H200's
    h100 = {"flexlab": {"status": "ok", "wall_ms": 0.2, "tflops": 280.0, "rel_l2": {"out": 2e-3}}}
    write("e_h100.json", "2026-05-01", [{"name": row, "variant": "softcap_causal", "mods": mods, "results": h100}],
          gpu="H100")
    listed = render.latest_results(tmp_path)["softcap"]
    by_gpu = {r["_gpu"]: r["results"] for r in listed}
    assert by_gpu["H200"]["flexlab"]["wall_ms"] == 0.123 and by_gpu["H100"]["flexlab"]["wall_ms"] == 0.2
    card = render.render_card(v, render.variant_pictures(v), listed)
    assert f"{row} (H100)" in card and f"{row} (H200)" in card


def test_committed_page_lists_every_variant():
    from flexlab.gallery import load_gallery
    page = (Path(__file__).parents[2] / "gallery" / "index.html").read_text()
    for name in load_gallery():
        assert f'id="{name}"' in page, f"gallery/index.html is stale: run python gallery/_render.py ({name})"
