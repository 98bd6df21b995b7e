"""The tunegen command line (installed as tunegen.cli)."""
