"""flexlab's exceptions.

Every error a user can trigger names the argument, the op, or the line of their own code at fault, and says how to
fix it. The classes subclass the builtin that callers would catch anyway (ValueError/TypeError/RuntimeError), so
flexlab is a drop-in for torch's flex_attention in existing try/except code.
"""
from __future__ import annotations


class FlexlabError(Exception):
    """Base class of every error raised by flexlab itself."""


class FlexlabValueError(FlexlabError, ValueError):
    """A value (shape, length, option) is wrong."""


class FlexlabTypeError(FlexlabError, TypeError):
    """A type (dtype, device, callable signature) is wrong."""


class UnsupportedModError(FlexlabError, NotImplementedError):
    """A score_mod/mask_mod uses something the code generator cannot lower.

    Carries the offending op and where it is in the user's code so notebooks can point at the line.
    """

    def __init__(self, op: str, file: str | None = None, line: int | None = None,
                 source_line: str | None = None, hint: str | None = None):
        self.op, self.file, self.line = op, file, line
        self.source_line, self.hint = source_line, hint
        where = f"{file}:{line}" if file and line else (f"line {line}" if line else "unknown location")
        msg = f"unsupported operation {op!r} in mod at {where}"
        if source_line:
            msg += f"\n    {source_line.strip()}"
        if hint:
            msg += f"\nhint: {hint}"
        super().__init__(msg)


class BackendUnavailableError(FlexlabError, RuntimeError):
    """The requested backend cannot run here (no GPU, wrong architecture, missing package)."""


class RecompileLimitError(FlexlabError, RuntimeError):
    """torch.compile would fall back to its slow eager flex_attention path; flexlab refuses to do that silently."""


class FallbackWarning(UserWarning):
    """backend="auto" ran torch's compiled flex_attention on a GPU because flexlab's kernels cannot run the call; the
    message says why (shown once per reason by Python's default filter)."""


def check_positive_int(name: str, value, where: str = "") -> None:
    """Raise a FlexlabValueError naming `name` (and the call, `where`) unless `value` is an int >= 1 (not a bool,
    not a float that would be truncated)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        prefix = f"{where}: " if where else ""
        raise FlexlabValueError(f"{prefix}{name} must be a positive int, got {value!r}")
