"""Summaries of any length (summary batches, pagedq/summaries.py): the document split into
chunks that fit the model (chunking), the map and reduce prompts around them (prompts), and
each document's stages as they advance inside its batch (documents)."""
