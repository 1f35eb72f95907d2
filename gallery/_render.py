"""Render the gallery as one static HTML page: pictures, code and the latest measured numbers of every variant.

    python gallery/_render.py [--out gallery/index.html] [--results benchmarks/results]

The page is self-contained (pictures are small PNGs embedded as data URIs, no scripts, no CDN), so it can be
opened from disk, attached to a report or served by any static host. Pictures are drawn here with a tiny PNG
encoder rather than plotly + kaleido, which would need a browser to export images.
"""
from __future__ import annotations

import argparse
import base64
import html
import re
import struct
import zlib
from pathlib import Path

import torch

from flexlab.bench.report import read_json, result_files

HERE = Path(__file__).resolve().parent
MAX_PIXELS = 192  # longest side of a heatmap
BLOCK_SIZE = 128  # the kernel tile the block map is drawn at

# (r, g, b) for block states 0 = empty, 1 = partial, 2 = full
BLOCK_COLOURS = torch.tensor([[245, 245, 245], [244, 162, 54], [33, 102, 172]], dtype=torch.uint8)


def png_bytes(rgb: torch.Tensor) -> bytes:
    """Encode an (H, W, 3) uint8 tensor as a PNG file (8-bit RGB, no interlace)."""
    height, width, _ = rgb.shape
    rows = torch.cat([torch.zeros(height, 1, dtype=torch.uint8), rgb.reshape(height, width * 3)], dim=1)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(rows.contiguous().numpy().tobytes(), 9)) + chunk(b"IEND", b""))


def _data_uri(rgb: torch.Tensor) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(rgb)).decode()


def _pool(values: torch.Tensor, max_pixels: int = MAX_PIXELS) -> torch.Tensor:
    """Average (Q, KV) values over cells so the longest side is at most `max_pixels`."""
    q, kv = values.shape
    cell = max(1, -(-max(q, kv) // max_pixels))
    pad = (0, (-kv) % cell, 0, (-q) % cell)
    padded = torch.nn.functional.pad(values[None, None].double(), pad, value=float("nan"))
    windows = padded.unfold(2, cell, cell).unfold(3, cell, cell)
    return windows.nanmean(dim=(-1, -2))[0, 0]


def _upscale(rgb: torch.Tensor, min_pixels: int = MAX_PIXELS) -> torch.Tensor:
    factor = max(1, min_pixels // max(rgb.shape[:2]))
    return rgb.repeat_interleave(factor, 0).repeat_interleave(factor, 1)


def density_image(kept: torch.Tensor) -> torch.Tensor:
    """Kept fraction per cell: white (masked) to dark blue (kept)."""
    frac = _pool(kept.float()).clamp(0, 1)
    white, blue = torch.tensor([255.0, 255.0, 255.0]), torch.tensor([8.0, 48.0, 107.0])
    rgb = white + frac[..., None] * (blue - white)
    return _upscale(rgb.round().to(torch.uint8))


def score_image(delta: torch.Tensor, kept: torch.Tensor | None) -> torch.Tensor:
    """What score_mod adds to a score of 0, diverging red (up) / blue (down); masked pairs grey."""
    values = delta.double().masked_fill(~kept, float("nan")) if kept is not None else delta.double()
    pooled = _pool(values)
    finite = pooled[torch.isfinite(pooled)]
    span = finite.abs().max().item() if finite.numel() else 1.0
    t = (pooled / (span or 1.0)).clamp(-1, 1)
    white = torch.tensor([247.0, 247.0, 247.0])
    red, blue = torch.tensor([178.0, 24.0, 43.0]), torch.tensor([33.0, 102.0, 172.0])
    rgb = torch.where(t[..., None] >= 0, white + t[..., None] * (red - white), white - t[..., None] * (blue - white))
    rgb = torch.where(torch.isfinite(t)[..., None], rgb, torch.tensor([200.0, 200.0, 200.0]))
    return _upscale(rgb.round().to(torch.uint8))


def curve_image(outputs: torch.Tensor, inputs: torch.Tensor, size: int = MAX_PIXELS) -> torch.Tensor:
    """score_mod(s) against s as a line plot (identity in grey), for mods that reshape scores instead of biasing."""
    rgb = torch.full((size, size, 3), 255, dtype=torch.uint8)
    span = max(inputs.abs().max().item(), outputs.abs().max().item()) or 1.0
    cols = torch.arange(size)
    to_row = lambda v: ((1 - (v / span + 1) / 2) * (size - 1)).round().long().clamp(0, size - 1)  # noqa: E731
    rgb[size // 2, :] = 225
    rgb[:, size // 2] = 225
    rgb[to_row(inputs), cols] = torch.tensor([190, 190, 190], dtype=torch.uint8)
    rows = to_row(outputs)
    for dr in (-1, 0, 1):
        rgb[(rows + dr).clamp(0, size - 1), cols] = torch.tensor([178, 24, 43], dtype=torch.uint8)
    return rgb


def block_image(states: torch.Tensor) -> torch.Tensor:
    """One square per kernel tile: empty (light), partial (orange), full (blue), with a 1-pixel grid."""
    n_q, n_kv = states.shape
    size = max(2, min(24, MAX_PIXELS // max(n_q, n_kv)))
    rgb = BLOCK_COLOURS[states.long()]
    rgb = rgb.repeat_interleave(size, 0).repeat_interleave(size, 1).clone()
    rgb[::size, :] = 255
    rgb[:, ::size] = 255
    return rgb


PICTURE_LENGTH = 1024  # long enough for a block map of 8 x 8 kernel tiles


def picture_lengths(variant) -> tuple[int, int]:
    """The variant's example lengths scaled up to about PICTURE_LENGTH, if its length rule allows."""
    q_len, kv_len = variant.example_lengths
    factor = max(1, PICTURE_LENGTH // max(q_len, kv_len))
    return (q_len * factor, kv_len * factor) if variant.accepts_lengths(q_len * factor, kv_len * factor) \
        else (q_len, kv_len)


def variant_pictures(variant, B: int = 1, H: int = 1) -> dict[str, torch.Tensor]:
    """The pictures of one variant at its picture lengths, for batch 0 and head 0."""
    import flexlab
    from flexlab.mods import evaluate_mask_mod, evaluate_score_mod, index_grid

    q_len, kv_len = picture_lengths(variant)
    mods = variant.build(B, H, q_len, kv_len)
    grid = index_grid(1, 1, q_len, kv_len, "cpu")
    pictures = {}
    kept = None
    if mods.mask_mod is not None:
        kept = evaluate_mask_mod(mods.mask_mod, *grid)[0, 0]
        pictures["mask"] = density_image(kept)
        block_mask = flexlab.create_block_mask(mods.mask_mod, 1, 1, q_len, kv_len, BLOCK_SIZE=BLOCK_SIZE)
        pictures["blocks"] = block_image(flexlab.block_states(block_mask)[0, 0])
    if mods.score_mod is not None and variant.name != "noop":
        zeros = torch.zeros(1, 1, q_len, kv_len, dtype=torch.float64)
        delta = evaluate_score_mod(mods.score_mod, zeros, *grid)[0, 0]
        if bool((delta != 0).any()):
            pictures["score"] = score_image(delta, kept)
        else:  # no bias at all: show how the mod reshapes a range of scores (at b = h = q = kv = 0)
            scores = torch.linspace(-100.0, 100.0, MAX_PIXELS, dtype=torch.float64)
            ramp = scores.reshape(1, 1, 1, -1).expand(1, 1, 1, MAX_PIXELS).contiguous()
            out = evaluate_score_mod(mods.score_mod, ramp, *index_grid(1, 1, 1, MAX_PIXELS, "cpu"))
            if not torch.allclose(out.flatten(), scores):
                pictures["curve"] = curve_image(out.flatten(), scores)
    if not pictures:
        pictures["mask"] = density_image(torch.ones(q_len, kv_len, dtype=torch.bool))
    return pictures


_GALLERY_REF = re.compile(r"gallery:([A-Za-z_][A-Za-z0-9_]*)")
_ROW_ALIASES = {"dense": "noop"}  # benchmark row variants that are a gallery variant under another name


CARD_KINDS = ("aux-grad-probe",)  # result files besides the benchmark's whose rows belong on the cards


def latest_results(results_dir: Path) -> dict[str, list[dict]]:
    """Benchmark rows per gallery variant; for each row and backend, the newest measurement across result files.

    Result files come from ``python -m flexlab.bench`` (``"schema": 1``) and from the learned-table training probe
    (``"kind": "aux-grad-probe"``); tuning sweeps, whose rows time debug builds with stages removed, are not shown.
    A row names the variants it uses in ``mods`` (e.g. ``"gallery:softcap(cap=20) + gallery:causal"``), so a
    combined row is listed under each of them.
    """
    merged: dict[tuple, dict] = {}  # (gpu, row name) -> {"row": row, "results": {backend: (stamp, result)}, ...}
    for path in result_files(results_dir):
        try:
            data = read_json(path)
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict) or not (data.get("schema") == 1 or data.get("kind") in CARD_KINDS):
            continue
        env = data.get("environment", {}) or {}
        stamp = f"{env.get('date_utc', '')}|{path.name}"
        for row in data.get("rows", []):
            if not isinstance(row, dict) or not row.get("name"):
                continue
            gpu = env.get("gpu", "")  # a row measured on two GPUs is two rows: numbers of one GPU never mix
            entry = merged.setdefault((gpu, row["name"]), {"row": row, "results": {}, "gpu": gpu, "files": set()})
            for backend, result in (row.get("results") or {}).items():
                held = entry["results"].get(backend)
                measured = result.get("status") == "ok"
                # a newer measurement wins; a newer "n/a" never hides an older real number
                if held is None or (stamp > held[0] and (measured or held[1].get("status") != "ok")):
                    entry["results"][backend] = (stamp, result)
                    entry["files"].add(path.name)
    rows: dict[str, list[dict]] = {}
    for _, entry in sorted(merged.items()):
        row = entry["row"]
        names = set(_GALLERY_REF.findall(str(row.get("mods", "")))) | {
            _ROW_ALIASES.get(row.get("variant"), row.get("variant"))}
        flat = dict(row, results={b: r for b, (_, r) in entry["results"].items()}, _gpu=entry["gpu"],
                    _file=", ".join(sorted(entry["files"])))
        for variant in filter(None, names):
            rows.setdefault(variant, []).append(flat)
    for variant, listed in rows.items():  # the variant's own rows first, then rows that combine it with others
        listed.sort(key=lambda r: (_ROW_ALIASES.get(r.get("variant"), r.get("variant")) != variant, r["name"]))
    return rows


def _cell(result: dict) -> str:
    if result.get("status") == "ok":
        checked = result.get("rel_l2")  # {"out": ...} or one number; training probes carry none of their own
        checked = checked.get("out") if isinstance(checked, dict) else checked
        title = f" title='rel-L2 vs fp64 {checked:.1e}'" if checked is not None else ""
        return (f"<td{title}>"
                f"{result.get('wall_ms', float('nan')):.3f} ms<br><span class='muted'>"
                f"{result.get('tflops', float('nan')):.0f} TFLOPS</span></td>")
    reason = html.escape(str(result.get("error", result.get("status", ""))))[:200]
    return f"<td class='muted' title='{reason}'>n/a</td>"


def _numbers_table(rows: list[dict]) -> str:
    if not rows:
        return "<p class='muted'>No GPU measurement of this variant yet.</p>"
    backends = []
    for row in rows:
        backends += [b for b in row.get("results", {}) if b not in backends]
    gpus = sorted({row["_gpu"] for row in rows if row.get("_gpu")})
    head = "".join(f"<th>{html.escape(b)}</th>" for b in backends)

    def label(row):  # rows of several GPUs on one card say which GPU they ran on
        return row.get("name", "") + (f" ({row['_gpu']})" if len(gpus) > 1 and row.get("_gpu") else "")
    body = "".join(f"<tr><td>{html.escape(label(row))}</td>"
                   + "".join(_cell(row["results"][b]) if b in row["results"] else "<td></td>" for b in backends)
                   + "</tr>" for row in rows)
    files = sorted({f for row in rows for f in row["_file"].split(", ") if f})
    return (f"<p class='muted'>Latest measurements ({html.escape(', '.join(gpus) or 'GPU')}; "
            f"{html.escape(', '.join(files))}); hover a cell for its error vs float64 or why it is n/a.</p>"
            f"<table class='nums'><tr><th>row</th>{head}</tr>{body}</table>")


_CSS = """
body{font-family:system-ui,sans-serif;margin:2rem auto;max-width:1100px;color:#222;padding:0 1rem}
.card{border:1px solid #ddd;border-radius:8px;padding:1rem 1.2rem;margin:1.2rem 0}
.card h2{margin:.2rem 0}.kind{font-size:.8rem;background:#eef;border-radius:4px;padding:1px 6px;margin-left:.5rem}
.pics{display:flex;gap:1rem;flex-wrap:wrap}.pics figure{margin:0}.pics figcaption{font-size:.8rem;color:#555}
pre{background:#f6f8fa;padding:.7rem;border-radius:6px;overflow-x:auto;font-size:.8rem}
table{border-collapse:collapse;font-size:.85rem}td,th{border:1px solid #ddd;padding:2px 8px;text-align:left}
.muted{color:#777;font-size:.85rem}nav{display:flex;flex-wrap:wrap;gap:.2rem .8rem;font-size:.85rem}
"""

_CAPTIONS = {"mask": "mask (kept fraction)", "score": "score_mod(0) (red +, blue -)",
             "curve": "score_mod(s) for s in [-100, 100] (grey: s)",
             "blocks": f"blocks at {BLOCK_SIZE}x{BLOCK_SIZE} (blue full, orange partial)"}


def render_card(variant, pictures: dict[str, torch.Tensor], rows: list[dict]) -> str:
    q_len, kv_len = picture_lengths(variant)
    params = "".join(f"<tr><td><code>{p.name}</code></td><td>{p.default}</td><td>{p.min} .. {p.max} "
                     f"(step {p.step})</td><td>{html.escape(p.description)}</td></tr>" for p in variant.params)
    params_html = (f"<table><tr><th>parameter</th><th>default</th><th>range</th><th></th></tr>{params}</table>"
                   if params else "<p class='muted'>No parameters.</p>")
    figures = "".join(f"<figure><img alt='{variant.name} {kind}' src='{_data_uri(img)}'>"
                      f"<figcaption>{_CAPTIONS[kind]}</figcaption></figure>" for kind, img in pictures.items())
    builtin = html.escape(variant.builtin_equivalent) if variant.builtin_equivalent else "none"
    return f"""<section class="card" id="{variant.name}">
<h2>{variant.name}<span class="kind">{variant.kind}</span></h2>
<p>{html.escape(variant.description)} <a href="{html.escape(variant.paper)}">paper</a></p>
<p class="muted">Lengths: {html.escape(variant.lengths_rule)}. Nearest built-in: <code>{builtin}</code>.
Pictures at Q_LEN={q_len}, KV_LEN={kv_len}, b=0, h=0.</p>
<div class="pics">{figures}</div>
{params_html}
<pre><code>{html.escape(variant.source)}</code></pre>
{_numbers_table(rows)}
</section>"""


def render_page(variants: dict, results_dir: Path) -> str:
    results = latest_results(results_dir)
    nav = "".join(f"<a href='#{name}'>{name}</a>" for name in variants)
    cards = "\n".join(render_card(v, variant_pictures(v), results.get(name, [])) for name, v in variants.items())
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>flexlab gallery</title><style>{_CSS}</style></head>
<body><h1>flexlab gallery: {len(variants)} attention variants</h1>
<p>Each variant is one file in <code>gallery/</code>: a <code>generate_*</code> factory with the mods and a
<code>VARIANT</code> record. Load one with <code>flexlab.gallery.get_variant(name).build(B, H, Q_LEN, KV_LEN)</code>.
Every variant is tested on CPU against an independent float64 rewrite and torch's flex_attention.</p>
<nav>{nav}</nav>
{cards}
</body></html>
"""


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "index.html")
    parser.add_argument("--results", type=Path, default=HERE.parent / "benchmarks" / "results")
    args = parser.parse_args(argv)
    from flexlab.gallery import load_gallery
    args.out.write_text(render_page(load_gallery(), args.results))
    return args.out


if __name__ == "__main__":
    import sys
    sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing flexlab
    print(main())
