"""Code generation: a spec rendered to CUDA source through the Jinja templates."""
