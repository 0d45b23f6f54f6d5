"""The bundled probe models, under the name `actcfg verify --model actcfg.probes:blocks` uses.

They live in `actcfg.verification.models`; this module keeps the documented spelling working.
"""

from actcfg.verification.models import Block, BlockStack, PartedBlock, blocks, linear_chain

__all__ = ["Block", "BlockStack", "PartedBlock", "blocks", "linear_chain"]
