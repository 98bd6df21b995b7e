"""Failed Variants are recorded so they are not retried; Winners keep the best peer's time.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"


def upgrade() -> None:
    with op.batch_alter_table("tunegen_winners") as batch:
        batch.add_column(sa.Column("peer_name", sa.String(64), nullable=True))
        batch.add_column(sa.Column("peer_ms", sa.Float, nullable=True))
    op.create_table(
        "tunegen_failures",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("gpu_id", sa.Integer, sa.ForeignKey("tunegen_gpus.id"), nullable=False),
        sa.Column("problem_id", sa.Integer, sa.ForeignKey("tunegen_problems.id"), nullable=False),
        sa.Column("variant_id", sa.Integer, sa.ForeignKey("tunegen_variants.id"), nullable=False),
        sa.Column("triton_version", sa.String(64), nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("gpu_id", "problem_id", "variant_id", "triton_version"),
    )


def downgrade() -> None:
    op.drop_table("tunegen_failures")
    with op.batch_alter_table("tunegen_winners") as batch:
        batch.drop_column("peer_ms")
        batch.drop_column("peer_name")
