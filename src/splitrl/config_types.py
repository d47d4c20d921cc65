"""Field types shared by the typed config sections (run, model, tokenizer)."""

from __future__ import annotations

import os
from typing import Annotated

from pydantic import AfterValidator

# A filesystem path as the user wrote it, with a leading ``~`` expanded: the shell does not expand
# it inside key=value overrides, so ``output_dir=~/runs/x`` made a directory named ``~`` in the
# working directory.
UserPath = Annotated[str, AfterValidator(os.path.expanduser)]
