"""One module per concept; each exposes router(), a fresh APIRouter that create_app() includes."""
