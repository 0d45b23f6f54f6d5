"""actcfg policies inside the trainers people use: Hugging Face `Trainer` and Lightning.

Import the one you need: `actcfg.integrations.hf` (needs transformers) or
`actcfg.integrations.lightning` (needs lightning). This package imports neither, so
`import actcfg` and `actcfg validate` stay light.
"""

from __future__ import annotations

__all__: list[str] = []
