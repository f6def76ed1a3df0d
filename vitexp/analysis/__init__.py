"""Audits of the papers' claims (vitexp-audit) and analyses of trained models (vitexp-analyze).

Audits of the papers' claims (``vitexp-audit``) and analyses of models (``vitexp-analyze``);
:func:`save_png`, the PNG writer of the token and head figures.
"""

from __future__ import annotations

from pathlib import Path


def save_png(fig, out: Path, title: str, dpi: int = 120) -> Path:
    """Title, tight layout (unless the figure has a layout engine), then the figure written atomically to
    ``out`` (PNG) and closed."""
    import matplotlib.pyplot as plt

    from vitexp.ledger import atomic_write

    fig.suptitle(title, fontsize=8)
    if fig.get_layout_engine() is None:
        fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, lambda tmp: fig.savefig(tmp, dpi=dpi, format="png"))
    plt.close(fig)
    return out
