"""Attention maps: record any block, roll out token attention, overlay heatmaps on images."""
