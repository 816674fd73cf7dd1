"""The SLO planner: sizes the prefill and decode Deployments on their own signals (docs/design.md §3).

``decision`` is the pure policy (metric snapshot in, replica count out); ``signals`` turns scraped Prometheus
text and the Redis queue into that snapshot; ``kube`` reads and patches the Deployments' scale subresource;
``planner`` runs one round; ``main`` is the ``pdserve planner`` command.
"""
