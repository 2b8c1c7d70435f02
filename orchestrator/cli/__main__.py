from orchestrate.cli.app import app

app()
