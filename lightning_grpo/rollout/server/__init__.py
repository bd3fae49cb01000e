"""The plumbing behind ``VLLMServerEngine`` (``rollout/vllm_server.py``): launching and stopping ``vllm serve``
processes (``process.py``; their ports in ``ports.py``, their exit hooks in ``orphans.py``), one JSON request and
the errors it raises (``http_json.py``), the trainer ranks sharing them (``ranks.py``), the HTTP client of a pool
(``client.py``), LoRA adapters served from folders (``adapters.py``), the shared-memory weight transfer registered
as a vLLM plugin (``shm_transfer.py``) and the check that a server serves the policy's model (``same_model.py``).
"""
