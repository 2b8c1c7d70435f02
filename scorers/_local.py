"""Finding reference weights on disk without ever downloading them."""

from __future__ import annotations

import json
import os
from pathlib import Path

from orchestrate.api.scoring import ScorerUnavailable


def local_snapshot(repo_id: str, env_var: str, revision: str | None = None) -> Path:
    """A model folder from `$env_var`, else from the Hugging Face cache (local_files_only).

    An env var that is set but wrong is an error, not a cue to look elsewhere: the user
    asked for those weights.
    """
    explicit = os.environ.get(env_var)
    if explicit:
        path = Path(explicit).expanduser()
        if not (path / "config.json").is_file():
            raise ScorerUnavailable(f"{env_var}={explicit} is not a model folder (no config.json)")
        return path
    try:
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except Exception as e:  # LocalEntryNotFoundError, or hub package trouble
        raise ScorerUnavailable(
            f"{repo_id} is not in the Hugging Face cache and {env_var} is unset "
            f"({type(e).__name__}); put the weights there or point {env_var} at a folder"
        ) from e
    if not (path / "config.json").is_file():
        raise ScorerUnavailable(f"cached snapshot {path} of {repo_id} has no config.json")
    return path


def hf_weight_files(path: Path) -> list[Path]:
    """The files `from_pretrained` reads for weights (same precedence), plus config.json."""
    for single, index in (
        ("model.safetensors", "model.safetensors.index.json"),
        ("pytorch_model.bin", "pytorch_model.bin.index.json"),
    ):
        if (path / single).is_file():
            return [path / "config.json", path / single]
        if (path / index).is_file():
            shards = sorted(set(json.loads((path / index).read_text())["weight_map"].values()))
            missing = [s for s in shards if not (path / s).is_file()]
            if missing:
                raise ScorerUnavailable(f"{path} lacks weight shards {missing}")
            return [path / "config.json", *(path / s for s in shards)]
    raise ScorerUnavailable(f"{path} holds no model weights (safetensors or pytorch_model.bin)")
