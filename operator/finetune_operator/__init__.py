"""finetune-operator: Kubernetes operator for fault-tolerant distributed LLM fine-tuning."""

__version__ = "0.1.0"
