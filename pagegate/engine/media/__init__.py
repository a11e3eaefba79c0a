"""Images in prompts: decoding untrusted images, each model family's preprocessing, and where an image sits in a prompt."""
