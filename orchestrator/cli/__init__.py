"""The `orchestrate` command line: the top room, the only one that imports reports."""

import warnings

# pydub (imported by the omnivoice package) warns on import when ffmpeg is missing; nothing
# here decodes compressed audio, so the warning is noise on every command.
warnings.filterwarnings("ignore", message="Couldn't find ffmpeg", category=RuntimeWarning)

from orchestrate.cli.app import app  # noqa: E402

__all__ = ["app"]
