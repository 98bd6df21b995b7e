"""The tuning store (installed as tunegen.tuning_db)."""
