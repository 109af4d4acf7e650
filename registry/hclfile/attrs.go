package hclfile

import (
	"fmt"
	"time"

	"github.com/hashicorp/hcl/v2"
)

// attr is one attribute of a block whose decoded object is a T: its name,
// whether it is required, and how its value is decoded into the object.
// Each block type's attributes are one table of attrs (see decode.go), so
// adding an attribute is one entry, usually built by strAttr, boolAttr,
// intAttr, numAttr, listAttr or durationAttr.
type attr[T any] struct {
	name       string
	isRequired bool
	decode     func(d *decoder, f field, x T)
}

// required returns a copy of a that HCL reports when it is left out.
func (a attr[T]) required() attr[T] {
	a.isRequired = true
	return a
}

// field is the attribute being decoded and where problems with it are
// reported: at keys its taint (see decoder.tainted) and its source range
// (for registry.Validate's errors).
type field struct {
	at   loc
	attr *hcl.Attribute
}

func (f field) rng() hcl.Range { return f.attr.Expr.Range() }

// sub names a part of the field (a map key), for problems with that part.
func (f field) sub(key string) loc { return f.at.with(f.at.field + "." + key) }

// check rejects a string value of the attribute called name with a summary
// and detail, or accepts it by returning "".
type check func(name, v string) (summary, detail string)

// notBlank rejects an empty or all-space value; detail is a format with
// one %s, the attribute's name.
func notBlank(detail string) check {
	return func(name, v string) (string, string) {
		if isBlank(v) {
			return "Empty " + name, fmt.Sprintf(detail, name)
		}
		return "", ""
	}
}

// strAttr decodes a string that passes every check into x with set.
func strAttr[T any](name string, set func(x T, v string), checks ...check) attr[T] {
	return attr[T]{name: name, decode: func(d *decoder, f field, x T) {
		v, ok := d.str(f.at, f.attr.Expr)
		if !ok {
			return
		}
		for _, c := range checks {
			if summary, detail := c(name, v); summary != "" {
				d.errorAt(f.at, f.rng(), summary, detail)
				return
			}
		}
		set(x, v)
	}}
}

// boolAttr decodes a bool into x with set.
func boolAttr[T any](name string, set func(x T, v bool)) attr[T] {
	return attr[T]{name: name, decode: func(d *decoder, f field, x T) {
		if v, ok := d.boolean(f.at, f.attr.Expr); ok {
			set(x, v)
		}
	}}
}

// intAttr decodes a whole number (32-bit) into x with set.
func intAttr[T any](name string, set func(x T, v int)) attr[T] {
	return attr[T]{name: name, decode: func(d *decoder, f field, x T) {
		if v, ok := d.integer(f.at, f.attr.Expr); ok {
			set(x, v)
		}
	}}
}

// numAttr decodes a number into x with set.
func numAttr[T any](name string, set func(x T, v float64)) attr[T] {
	return attr[T]{name: name, decode: func(d *decoder, f field, x T) {
		if v, ok := d.number(f.at, f.attr.Expr); ok {
			set(x, v)
		}
	}}
}

// listAttr decodes a list of strings into x with set; elements that are
// not strings are reported and left out.
func listAttr[T any](name string, set func(x T, v []string)) attr[T] {
	return attr[T]{name: name, decode: func(d *decoder, f field, x T) {
		elems, diags := hcl.ExprList(f.attr.Expr)
		if !d.add(f.at, diags) {
			return
		}
		var vs []string
		for _, e := range elems {
			if s, ok := d.str(f.at, e); ok {
				vs = append(vs, s)
			}
		}
		set(x, vs)
	}}
}

// durationAttr decodes a Go duration string of at least 1ms into x with
// set, in whole milliseconds.
func durationAttr[T any](name string, set func(x T, ms int)) attr[T] {
	return attr[T]{name: name, decode: func(d *decoder, f field, x T) {
		s, ok := d.str(f.at, f.attr.Expr)
		if !ok {
			return
		}
		dur, err := time.ParseDuration(s)
		switch {
		case err != nil:
			d.errorAt(f.at, f.rng(), "Invalid duration",
				fmt.Sprintf("%s %q is not a duration; write it like \"50ms\" or \"1s\".", name, s))
		case dur < time.Millisecond:
			d.errorAt(f.at, f.rng(), "Invalid duration",
				fmt.Sprintf("%s %q must be at least 1ms.", name, s))
		default:
			set(x, int(dur/time.Millisecond))
		}
	}}
}

// body is the table of one block type: its attributes and the block types
// nested in it, and the HCL schema both make.
type body[T any] struct {
	attrs  []attr[T]
	schema *hcl.BodySchema
}

func newBody[T any](attrs []attr[T], blocks ...hcl.BlockHeaderSchema) *body[T] {
	s := &hcl.BodySchema{Blocks: blocks}
	for _, a := range attrs {
		s.Attributes = append(s.Attributes, hcl.AttributeSchema{Name: a.name, Required: a.isRequired})
	}
	return &body[T]{attrs: attrs, schema: s}
}

// decodeBody checks b against spec's schema and decodes every attribute
// present into x, in table order. at(name) says where each attribute's
// problems are reported; its source range is recorded there too. The
// content is returned for the nested blocks and cross-attribute checks.
func decodeBody[T any](d *decoder, b hcl.Body, spec *body[T], at func(name string) loc, x T) *hcl.BodyContent {
	content, diags := b.Content(spec.schema)
	d.diags = append(d.diags, diags...)
	for _, a := range spec.attrs {
		l := at(a.name)
		ha, ok := content.Attributes[a.name]
		if !ok {
			if a.isRequired {
				d.tainted[l] = true // the schema reported it
			}
			continue
		}
		d.ranges[l] = ha.Expr.Range()
		a.decode(d, field{at: l, attr: ha}, x)
	}
	return content
}
