"""Side-by-side benchmark of kvmesh against real peer routers (vllm-router, sglang-router) on
identical vLLM OpenAI servers (docs/peers.md). Everything here is benchmark-only: peers come from the
`bench` extra, and nothing in the serving path imports this package."""
