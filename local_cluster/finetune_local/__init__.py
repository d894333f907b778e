"""Embedded local cluster for ``ftjob run --local`` and the end-to-end tests (DESIGN.md §9).

:class:`LocalCluster` (in :mod:`.cluster`) starts a Kubernetes API emulator (:mod:`.apiserver`,
built on kmock) and a local kubelet (:mod:`.kubelet`) that runs pods as local processes.
"""
