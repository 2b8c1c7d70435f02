"""The `orchestrate` command line: the top room, the only one that imports reports."""

import os
import warnings

# MLflow logs its store set-up (alembic migrations) at INFO on every first use: noise before
# each command's output. A user who wants it sets MLFLOW_LOGGING_LEVEL=INFO.
os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")

# pydub (imported by the omnivoice package) warns on import when ffmpeg is missing; nothing
# here decodes compressed audio, so the warning is noise on every command.
warnings.filterwarnings("ignore", message="Couldn't find ffmpeg", category=RuntimeWarning)

from orchestrate.cli.app import app  # noqa: E402

__all__ = ["app"]
