"""Alembic environment: runs on the connection the store hands over, with tunegen's own version
table so Optuna's alembic history in the same database stays separate."""

from alembic import context

from tunegen.tuning_db.models import Base

VERSION_TABLE = "tunegen_alembic_version"

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    version_table=VERSION_TABLE,
    render_as_batch=True,
    compare_type=True,
)
with context.begin_transaction():
    context.run_migrations()
