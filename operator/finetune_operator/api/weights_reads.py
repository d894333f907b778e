"""What the trainer's reads of pretrained weights hold at once per rank: constants shared by
the trainer (finetune_trainer.safetensors_ranges, replica_loading), which reads so, and the
planner (finetune_operator.planner.loading), which counts it in `plan.loadPeakBytes`."""

from __future__ import annotations

# Raw bytes of ranged GETs in flight at once (a DCP load's batch of requests).
READ_BATCH_BYTES = 256 << 20
# A GET's part at most (finetune_trainer.ranged_reads): the S3 client (aiohttp's
# StreamReader.read) joins a response's blocks into its bytes, both alive for a moment, so
# beside a batch the reads hold up to one part more (measured: bench/read_peak.py).
READ_PART_BYTES = 64 << 20
# A replicated rank's (DDP, ZeRO-1/2) stripes of one DCP load from an object store, in the
# replica's dtype: at most this, or one larger tensor's stripe alone.
STRIPE_BYTES = 256 << 20
