"""RL cycles over many servers: stand-in vLLM servers and the cycle benchmark."""
