"""Starting weights by tag: ``backbone.pretrained=weights:<tag>`` resolved through ``conf/weights.yaml``.

Its reasoning: docs/commands.md, "vitexp/config/weights.py".
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Any

from vitexp import CONF_DIR

PREFIX = "weights:"
HUB_FILES = ("model.safetensors", "pytorch_model.bin", "open_clip_pytorch_model.bin")


@lru_cache(maxsize=1)
def weights_map() -> dict[str, dict[str, Any]]:
    """``conf/weights.yaml``: {tag: {file, hub, source}}."""
    import yaml

    return yaml.safe_load((CONF_DIR / "weights.yaml").read_text()) or {}


def is_tag(value: Any) -> bool:
    return isinstance(value, str) and value.startswith(PREFIX)


def _hub_repo(hub: str) -> str | None:
    """The Hugging Face repository timm loads ``hub`` (``model.tag``) from."""
    from timm.models import get_pretrained_cfg

    cfg = get_pretrained_cfg(hub)
    return getattr(cfg, "hf_hub_id", None) if cfg is not None else None


def _from_hub(repo: str, download: bool) -> str | None:
    from huggingface_hub import try_to_load_from_cache

    cache_dir = os.environ.get("HF_HUB_CACHE") or None  # read now (the hub library reads it once, at import)
    for name in HUB_FILES:
        cached = try_to_load_from_cache(repo, name, cache_dir=cache_dir)
        if isinstance(cached, str):
            return cached
    if download:
        from huggingface_hub import hf_hub_download

        return hf_hub_download(repo, HUB_FILES[0], cache_dir=cache_dir)
    return None


def resolve(value: str) -> str:
    """The file of ``weights:<tag>`` (module docstring)."""
    tag = value[len(PREFIX) :] if is_tag(value) else value
    known = weights_map()
    if tag not in known:
        raise FileNotFoundError(f"weights:{tag}: not a tag of conf/weights.yaml (tags: {sorted(known)})")
    entry = known[tag]
    looked = []
    folder = os.environ.get("VITEXP_WEIGHTS")
    if folder:
        path = Path(folder).expanduser() / entry["file"]
        if path.is_file():
            return str(path)
        looked.append(str(path))
    else:
        looked.append(f"$VITEXP_WEIGHTS/{entry['file']} ($VITEXP_WEIGHTS is not set)")
    repo = _hub_repo(entry["hub"]) if entry.get("hub") else None
    if repo:
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
        download = os.environ.get("VITEXP_WEIGHTS_HUB") == "1" and not offline
        try:
            found = _from_hub(repo, download)
        except Exception as err:  # noqa: BLE001 - no network, no such file on the hub
            raise FileNotFoundError(
                f"weights:{tag}: the hub download of {repo} failed ({type(err).__name__}: {err})"
            ) from None
        if found:
            return found
        looked.append(
            f"the Hugging Face hub cache for {repo}"
            + (
                ""
                if download
                else (
                    " (not downloaded: set VITEXP_WEIGHTS_HUB=1 to fetch it into the cache)"
                    if not offline
                    else " (HF_HUB_OFFLINE is set)"
                )
            )
        )
    raise FileNotFoundError(
        f"weights:{tag}: {entry['file']} ({entry.get('source', 'no source given')}) not found; "
        f"looked in {'; '.join(looked)}"
    )


def resolve_weights(spec: str | None, results_dir: Path | str | None = None) -> str | None:
    """A ``backbone.pretrained`` value as a file path: a path is returned as given;
    ``run:<experiment>`` / ``run:<run_id>`` becomes the ``weights`` file of :func:`weights_run`;
    ``weights:<tag>`` the file :func:`resolve` finds."""
    from vitexp.ledger import RUN_WEIGHTS_PREFIX, default_results_dir, weights_file, weights_run

    if is_tag(spec):
        return resolve(str(spec))
    if not spec or not str(spec).startswith(RUN_WEIGHTS_PREFIX):
        return spec
    where = Path(results_dir) if results_dir else default_results_dir()
    return str(weights_file(weights_run(spec, where), where))
