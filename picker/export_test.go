package picker

// SetDumpChunkEvents sets how many events one staging chunk of DecodeDump holds and returns a
// function that restores the default (tests of chunked restores).
func SetDumpChunkEvents(n int) (restore func()) {
	old := dumpChunkEvents
	dumpChunkEvents = n
	return func() { dumpChunkEvents = old }
}
