"""Ray Serve parts: the OpenAI-compatible ingress, the kvmesh request router, the vLLM engine replicas,
and the `kvmesh` command line."""
