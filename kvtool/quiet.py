"""Keep transformers', datasets' and huggingface_hub's own progress bars out of kvtool's output.

"Loading weights: 100%|...", "Generating train split", "Writing model shards" are not
kvtool's progress and leaked into API and CLI output. `quiet_progress_bars()` turns them
off around kvtool's calls into those libraries and restores the caller's setting after,
so a program that uses kvtool keeps its own choice for its own calls.
"""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def quiet_progress_bars():
    """Disable the three libraries' progress bars inside the block; restore them after."""
    import datasets.utils.logging as datasets_logging
    import huggingface_hub.utils as hub_utils
    from transformers.utils import logging as transformers_logging

    was = (transformers_logging.is_progress_bar_enabled(), datasets_logging.is_progress_bar_enabled(),
           not hub_utils.are_progress_bars_disabled())
    transformers_logging.disable_progress_bar()
    datasets_logging.disable_progress_bar()
    hub_utils.disable_progress_bars()
    try:
        yield
    finally:
        for enabled, enable in zip(was, (transformers_logging.enable_progress_bar, datasets_logging.enable_progress_bar,
                                         hub_utils.enable_progress_bars)):
            if enabled:
                enable()
