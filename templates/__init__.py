"""Kernel templates (Jinja2): data installed as tunegen.templates; see attention_fwd.py.j2."""
