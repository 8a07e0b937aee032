"""Trace replay, an operator's sizing tool: ``kvtier replay --trace NAME|FILE`` plays a request trace (Mooncake
FAST'25 format) through kvtier's real tiers beside an exact LRU model of them, and reports the hit rates, the
bytes moved and the time to first token a given host tier and store capacity give (:mod:`.command`).
``kvtier bench replay`` is the same command under its former name."""
