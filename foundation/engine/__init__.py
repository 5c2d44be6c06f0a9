"""The engine protocol family: how engines are named and asked (`api`), what they serve
(`info`), their load (`load`)."""
