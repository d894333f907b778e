# finetune-operator image: the kopf operator only. No torch, no trainer extras (DESIGN.md §2, §10).
# Build from the repository root:  docker build -t finetune-operator:0.1.0 .

FROM python:3.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator/ operator/
# setuptools looks for packages in trainer_image/ and local_cluster/ too; the operator image
# ships none of them (no trainer, no local-cluster emulator).
RUN mkdir trainer_image local_cluster \
    && pip install --no-cache-dir --prefix=/install .

FROM python:3.11-slim-bookworm
LABEL org.opencontainers.image.title="finetune-operator" \
      org.opencontainers.image.description="Kubernetes operator for fault-tolerant distributed LLM fine-tuning" \
      org.opencontainers.image.source="https://github.com/finetune-operator/finetune-operator" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
COPY --from=build /install /usr/local
# A numeric non-root user, so `runAsNonRoot: true` can be verified by the kubelet.
RUN groupadd --gid 65532 operator \
    && useradd --uid 65532 --gid 65532 --no-create-home --shell /usr/sbin/nologin operator \
    && python -c "import finetune_operator.handlers" \
    && ! python -c "import finetune_local" 2>/dev/null \
    && ! python -c "import torch" 2>/dev/null
USER 65532:65532
# 8080: kopf liveness (/healthz); 9090: operator metrics (/metrics).
EXPOSE 8080 9090
ENTRYPOINT ["ftjob", "operator"]
CMD ["--all-namespaces", "--liveness=http://0.0.0.0:8080/healthz", "--standalone", "--metrics-port=9090"]
