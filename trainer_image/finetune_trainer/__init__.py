"""The trainer run by torchrun in every worker pod (DESIGN.md §6).

`python -m finetune_trainer --config /etc/finetune/job.json`; one process per rank.
"""

__all__: list[str] = []
