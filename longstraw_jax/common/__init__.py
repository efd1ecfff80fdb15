"""What every layer uses: host-side input checks with errors that name the field and the bound (`validation`) and
progress ticks from inside compiled loops (`progress`)."""
