"""Records and the files that hold them: the record schema, JSONL in and out, outputs written
whole, and their provenance.
"""
