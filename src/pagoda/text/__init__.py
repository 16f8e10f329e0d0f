"""Text in and out of token ids: the model directory's tokenizer, its chat template, and a pool of tokenizer
copies for threads. A leaf: the engine, the server, the router and the CLI all read it; it reads none of them."""
