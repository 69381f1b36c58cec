"""Load tester for the engine (gRPC) and the OpenAI proxy (HTTP streaming); see loadtest/README.md."""
