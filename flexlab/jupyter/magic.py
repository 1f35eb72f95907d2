"""``%%flexattn``: run the score_mod / mask_mod defined in a cell and show the result panel.

    %load_ext flexlab
    %%flexattn -B 2 -H 8 -S 4096 -D 128 --dtype bf16 --compare torch,sdpa --show mask,blocks,code,timing -o result
    def mask_mod(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

The cell runs with the notebook's variables visible; the mods it defines are put back into the namespace. A
re-run of an unchanged cell with unchanged arguments is answered from a cache (the panel says so).
"""
from __future__ import annotations

import dataclasses

from IPython.core import magic_arguments
from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.display import display

from .experiment import BACKENDS, DTYPES, CodeError, RunSpec, load_mods, run_experiment
from .panel import SECTIONS, ErrorDisplay, ResultPanel


def _default_device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def _split(text: str, allowed: tuple, what: str) -> tuple:
    items = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = [x for x in items if x not in allowed]
    if unknown or not items:
        raise ValueError(f"--{what}: unknown or empty {unknown or text!r}; choose from {', '.join(allowed)}")
    return items


def _fingerprint(value):
    import torch
    if isinstance(value, (bool, int, float, str, type(None))):
        return value
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value), value._version)
    return ("object", id(value))


def captured_state(fn) -> tuple:
    """What a mod reads from outside itself (closure cells and the globals its code names), by value or identity."""
    if fn is None:
        return ()
    code = getattr(fn, "__code__", None)
    cells = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            cells.append(cell.cell_contents)
        except ValueError:
            cells.append(None)
    names = code.co_names if code is not None else ()
    glb = getattr(fn, "__globals__", {})
    return tuple(_fingerprint(v) for v in cells) + tuple((n, _fingerprint(glb[n])) for n in names if n in glb)


@magics_class
class FlexAttnMagics(Magics):
    def __init__(self, shell=None):
        super().__init__(shell)
        self.cache: dict = {}

    @magic_arguments.magic_arguments()
    @magic_arguments.argument("-B", type=int, default=1, help="batch size (default 1)")
    @magic_arguments.argument("-H", type=int, default=4, help="query heads (default 4)")
    @magic_arguments.argument("-S", type=int, default=512, help="query sequence length (default 512)")
    @magic_arguments.argument("--kv-len", type=int, default=None, help="key/value length (default: -S)")
    @magic_arguments.argument("-D", type=int, default=64, help="head dim (default 64)")
    @magic_arguments.argument("--dtype", default="bf16", choices=sorted(DTYPES), help="input dtype (default bf16)")
    @magic_arguments.argument("--compare", default=None,
                              help=f"comma-separated backends from {','.join(BACKENDS)}; default: reference,torch "
                                   "on CPU and cute,torch,sdpa,flash on a GPU")
    @magic_arguments.argument("--show", default=",".join(SECTIONS),
                              help=f"panel sections, comma-separated from {','.join(SECTIONS)}")
    @magic_arguments.argument("--report", action="store_true",
                              help="add the compile report (PTX, registers, SASS mix) of our kernel to the source tab")
    @magic_arguments.argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    @magic_arguments.argument("--no-cache", action="store_true", help="run again even if the cell is unchanged")
    @magic_arguments.argument("-o", "--output", default=None, help="store the RunResult in this variable")
    @cell_magic
    def flexattn(self, line, cell):
        """Run the cell's score_mod/mask_mod against the float64 reference and the chosen backends."""
        args = magic_arguments.parse_argstring(self.flexattn, line)
        try:
            device = args.device or _default_device()
            backends = _split(args.compare or ("reference,torch" if device == "cpu" else "cute,torch,sdpa,flash"),
                              BACKENDS, "compare")
            show = _split(args.show, SECTIONS, "show")
            spec = RunSpec(B=args.B, H=args.H, S=args.S, D=args.D, dtype=args.dtype, backends=backends,
                           kv_len=args.kv_len, device=device)
        except ValueError as err:
            display(ErrorDisplay(err))
            return None
        try:
            mods = load_mods(cell, B=spec.B, H=spec.H, Q_LEN=spec.S, KV_LEN=spec.Skv, device=device,
                             env=self.shell.user_ns if self.shell is not None else None)
        except CodeError as err:
            display(ErrorDisplay(err))
            return None
        # The cell text alone is not enough: the mods may read notebook variables that changed since.
        key = (cell, spec, show, args.report, captured_state(mods.score_mod), captured_state(mods.mask_mod))
        result = None if args.no_cache else self.cache.get(key)
        if self.shell is not None:
            for name in ("score_mod", "mask_mod"):
                fn = getattr(mods, name)
                if fn is not None:
                    self.shell.user_ns[name] = fn
        if result is not None:
            result = dataclasses.replace(result, cached=True)
        else:
            try:
                result = run_experiment(mods, spec)
            except CodeError as err:
                display(ErrorDisplay(err))
                return None
            except Exception as err:                               # noqa: BLE001 - the kernel keeps running
                display(ErrorDisplay(err))
                return None
            self.cache[key] = result
        if args.output and self.shell is not None:
            self.shell.user_ns[args.output] = result
        panel = ResultPanel(result, show=show, user_code=cell, compile_report=args.report)
        display(panel.widget())
        return None


def load_ipython_extension(ipython) -> None:
    ipython.register_magics(FlexAttnMagics)


def unload_ipython_extension(ipython) -> None:
    magics = ipython.magics_manager.registry.get("FlexAttnMagics")
    if magics is not None:
        ipython.magics_manager.magics["cell"].pop("flexattn", None)
        ipython.magics_manager.registry.pop("FlexAttnMagics", None)
