from blockmgr.block_manager import BlockCopies, BlockManager, PrefixHit
from blockmgr.block_pool import Block, BlockKey, BlockPool, NoFreeBlocksError

__all__ = ["Block", "BlockCopies", "BlockKey", "BlockManager", "BlockPool", "NoFreeBlocksError", "PrefixHit"]
