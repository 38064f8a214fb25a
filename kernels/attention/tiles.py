"""The attention's key tile: the one constant every attention path (torch, Triton, split, shared-prefix)
shares, in a module of its own so that the op, its launchers and the settings import it without
importing each other.

Keys are reduced in tiles of KEY_TILE positions anchored at absolute position 0 (tile t holds
positions 64t .. 64t + 63), tile after tile in order. The tile fixes which keys are summed together,
so it is never tuned per shape; a key split is a whole number of tiles.
"""

# Keys per tile. Fixed (never tuned per shape) because it sets the order of the additions.
KEY_TILE = 64
