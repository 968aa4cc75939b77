package tokenizer

import (
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/ardanlabs/jinja"
)

// timeNow is the clock of the templates' strftime_now (tests pin it).
var timeNow = time.Now

// strftimeNowName is the template global transformers defines as
// datetime.now().strftime(format). ardanlabs/jinja's own version maps directives onto a Go
// layout, which rewrites literal text that looks like a layout ("Today is 1 2" loses its
// digits) and lacks %j, %-d, %e and others, so kvepp passes this one in the render data.
const strftimeNowName = "strftime_now"

var strftimeNow = jinja.NewCallable(strftimeNowName, func(args []jinja.Value, _ map[string]jinja.Value) (jinja.Value, error) {
	if len(args) != 1 || !args[0].IsString() {
		return jinja.Value{}, fmt.Errorf("strftime_now() takes exactly one string argument")
	}
	return jinja.NewString(pyStrftime(timeNow(), args[0].AsString())), nil
})

// pyStrftime formats t like Python's datetime.strftime on Linux (glibc directives, the "-"
// flag for no padding); an unknown directive is copied through unchanged, as glibc does.
func pyStrftime(t time.Time, format string) string {
	var b strings.Builder
	for i := 0; i < len(format); i++ {
		c := format[i]
		if c != '%' || i+1 >= len(format) {
			b.WriteByte(c)
			continue
		}
		start := i
		i++
		noPad := false
		if format[i] == '-' && i+1 < len(format) {
			noPad = true
			i++
		}
		num := func(v, width int) {
			s := strconv.Itoa(v)
			if !noPad {
				for len(s) < width {
					s = "0" + s
				}
			}
			b.WriteString(s)
		}
		_, week := t.ISOWeek()
		switch format[i] {
		case 'a':
			b.WriteString(t.Weekday().String()[:3])
		case 'A':
			b.WriteString(t.Weekday().String())
		case 'w':
			num(int(t.Weekday()), 1)
		case 'u':
			num((int(t.Weekday())+6)%7+1, 1)
		case 'd':
			num(t.Day(), 2)
		case 'e':
			if noPad {
				num(t.Day(), 1)
			} else {
				fmt.Fprintf(&b, "%2d", t.Day())
			}
		case 'b', 'h':
			b.WriteString(t.Month().String()[:3])
		case 'B':
			b.WriteString(t.Month().String())
		case 'm':
			num(int(t.Month()), 2)
		case 'y':
			num(t.Year()%100, 2)
		case 'Y':
			num(t.Year(), 1)
		case 'C':
			num(t.Year()/100, 2)
		case 'H':
			num(t.Hour(), 2)
		case 'I':
			h := t.Hour() % 12
			if h == 0 {
				h = 12
			}
			num(h, 2)
		case 'p':
			if t.Hour() < 12 {
				b.WriteString("AM")
			} else {
				b.WriteString("PM")
			}
		case 'M':
			num(t.Minute(), 2)
		case 'S':
			num(t.Second(), 2)
		case 'f':
			num(t.Nanosecond()/1000, 6)
		case 'j':
			num(t.YearDay(), 3)
		case 'V':
			num(week, 2)
		case 'z':
			b.WriteString(t.Format("-0700"))
		case 'Z':
			b.WriteString(t.Format("MST"))
		case 'D':
			b.WriteString(pyStrftime(t, "%m/%d/%y"))
		case 'F':
			b.WriteString(pyStrftime(t, "%Y-%m-%d"))
		case 'R':
			b.WriteString(pyStrftime(t, "%H:%M"))
		case 'T':
			b.WriteString(pyStrftime(t, "%H:%M:%S"))
		case 'c':
			b.WriteString(pyStrftime(t, "%a %b %e %H:%M:%S %Y"))
		case 'x':
			b.WriteString(pyStrftime(t, "%m/%d/%y"))
		case 'X':
			b.WriteString(pyStrftime(t, "%H:%M:%S"))
		case 'n':
			b.WriteByte('\n')
		case 't':
			b.WriteByte('\t')
		case '%':
			b.WriteByte('%')
		default:
			b.WriteString(format[start : i+1])
		}
	}
	return b.String()
}
