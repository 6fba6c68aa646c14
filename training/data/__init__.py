"""Data: SFT JSONL loading, tokenization with loss masks (and the account of every record cut
or dropped), packing, prefix sharing, DataBuffer.

Pure functions on records, token ids and tensors, plus the DataBuffer (a resumable cursor).
Depends on nothing else in `training` (the lowest layer).
"""
