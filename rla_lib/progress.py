"""Progress bars where people wait: tqdm's notebook bars in a Jupyter kernel, nothing in scripts and tests.

Every long-running function takes `progress`: True or False forces it; None (the default) shows bars only
inside a Jupyter kernel (JupyterLab, where `tqdm.auto` draws a widget), unless RLA_PROGRESS=0: batch runs
(`make run-all`, the notebook tests) set it, so executed notebooks hold results, not frozen bars. Scripts and
tests stay quiet unless they ask. Progress only: no numerics here.
"""

from tqdm.auto import tqdm

from .settings import setting


def in_kernel() -> bool:
    """Whether this process is a Jupyter kernel (where tqdm.auto draws notebook widgets)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and "IPKernelApp" in shell.config


def wanted(progress: bool | None) -> bool:
    """`progress` resolved: None means "in a Jupyter kernel, unless RLA_PROGRESS=0"."""
    if progress is None:
        return in_kernel() and setting("RLA_PROGRESS") != "0"
    return bool(progress)


def bar(iterable=None, progress: bool | None = None, **tqdm_kwargs):
    """`tqdm.auto.tqdm(iterable)`, disabled unless `wanted(progress)`."""
    return tqdm(iterable, disable=not wanted(progress), **tqdm_kwargs)


def vllm_bar(progress: bool | None, desc: str):
    """vLLM's `use_tqdm` argument: False, or a bar factory that clears itself when done (no clutter left)."""
    if not wanted(progress):
        return False
    def factory(*args, **kwargs):  # vLLM names its bars (adding requests, processed prompts): keep that name
        return tqdm(*args, **(kwargs | {"desc": f"{desc}: {kwargs.get('desc', '')}".rstrip(": "), "leave": False}))

    return factory
