"""The M6 model's optional packages (pyproject's ``[m6]`` extra): Pillow for images, sacrebleu for
BLEU-4. They are imported where they are used, so that ``import m6_moe`` and its registration with
moetrain (which every ``moetrain`` command performs) need neither; a use without them is one
``ImportError`` line naming the install command."""

from __future__ import annotations

INSTALL = "pip install 'moetrain[m6]'"


def pillow():
    """The ``PIL`` package with ``PIL.Image`` and ``PIL.ImageDraw`` imported."""
    try:
        import PIL.Image
        import PIL.ImageDraw
    except ImportError:
        raise ImportError(
            f"the M6 model reads and draws images with Pillow, which is not installed ({INSTALL})"
        ) from None
    return PIL


def sacrebleu_bleu():
    """``sacrebleu.metrics.BLEU``."""
    try:
        from sacrebleu.metrics import BLEU
    except ImportError:
        raise ImportError(
            f"BLEU-4 needs the 'sacrebleu' package, which is not installed ({INSTALL})"
        ) from None
    return BLEU
